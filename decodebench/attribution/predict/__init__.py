"""Kernel results become a decode step: the step's types (:mod:`.step`, a leaf), the step predicted
from stored results (:mod:`.prediction`), what a change would buy (:mod:`.whatif`, every kind of
what-if through one registry; :mod:`.ep`, :mod:`.speculative`), the step on another machine
(:mod:`.targets`, :mod:`.project`), and all of it as one answer per load (:mod:`.scenarios`,
:mod:`.chart`)."""
