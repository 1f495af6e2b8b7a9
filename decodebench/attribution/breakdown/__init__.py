"""A profiled decode step becomes components: one rank's profiler trace read as data (:mod:`.trace`),
its kernels sorted into the model's components per step (:mod:`.components`), the host's share of
the step (:mod:`.steps`), and the profiler window a live server opens (:mod:`.profile`)."""
