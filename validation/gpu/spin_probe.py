"""How torch.cuda._sleep's run time grows with the cycles asked, near its floor and far above it,
timed with decodebench's kernel timer (CUPTI activity sum) and CUDA-graph replay; the spin model of
decodebench/inject.py (a curve read between measured rungs) fitted at every other rung, and each
rung's error against it (the rungs between the fitted ones test the interpolation).
Usage: python3 validation/gpu/spin_probe.py [OUT.json]"""

import json
import sys

import torch

from decodebench import stats
from decodebench.inject import SpinModel
from decodebench.timing import Budget, TimerMode, measure

device = torch.device("cuda", 0)
budget = Budget(warmup_ms=5, budget_ms=200, min_samples=10)
cycles = (1, 10, 25, 50, 100, 200, 400, 800, 1600, 3200, 10_000, 50_000, 200_000)
rows = []
for mode in (TimerMode.KERNEL, TimerMode.GRAPH):
    runs = {n: measure(lambda n=n: torch.cuda._sleep(n), mode=mode, device=device, budget=budget) for n in cycles}
    floors = {n: stats.floor(m.samples) for n, m in runs.items()}
    # the model inject.py builds: fitted at every other rung, read at the rungs between
    fitted = {n: floor for i, (n, floor) in enumerate(floors.items()) if i % 2 == 0 or n == cycles[-1]}
    model = SpinModel.from_runs(fitted)
    print(f"{mode.value}: floor {model.floor_s * 1e6:.3f} us; fitted at {sorted(fitted)}")
    for n, m in runs.items():
        predicted = model.seconds_for(n)
        rows.append({"timer": mode.value, "cycles": n, "floor_s": floors[n], "median_s": m.median,
                     "model_s": predicted, "calls_per_sample": m.calls_per_sample})
        print(f"  {n:>7} cycles: floor {floors[n] * 1e6:8.3f} us, median {m.median * 1e6:8.3f} us,"
              f" model {predicted * 1e6:8.3f} us ({floors[n] / predicted - 1:+.1%})")
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(device), "rows": rows}, f, indent=1)
