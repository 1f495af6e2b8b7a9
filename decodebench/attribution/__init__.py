"""The decode step joined to its parts, along the data flow:

* :mod:`.breakdown`: a profiled step becomes components (trace -> kernels -> components);
* :mod:`.predict`: kernel results become a step, with what-ifs, projections and scenarios;
* :mod:`.analyse` and :mod:`.report`: the two set side by side for one load, the table and chart;
* :mod:`.depth`: a reduced-depth server to the model's full depth (both sides use it);
* :mod:`.options`: the prediction's options, declared once; :mod:`.cli`: the offline commands
  (``python -m decodebench breakdown | scenarios | steps``).
"""
