"""The projection's measured error bands, per pair of SM designs, written into the package's bands.json.

    python validation/projection/bands.py > decodebench/attribution/predict/bands.json

* sm90 -> sm90: the lowest and highest decode-step error of the five same-code H200 SXM / H100 SXM pairs,
  both directions, M = 1, 64, 256 (``h200-vs-h100*/crosscheck.json``, made by crosscheck.py);
* sm90 -> sm120: the lowest and highest residual of the box's projected TPOT against every like-for-like
  published figure of the box (``box-rtx-pro-6000-x8-pcie/box.json``, made by box.py): not a step
  measured here, and carrying what the suite cannot model (SM120 kernels, trained routing, fp8 KV).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def hopper() -> dict:
    files = sorted(HERE.glob("h200-vs-h100*/crosscheck.json"))
    errors = [row["rule"]["error"] for f in files for d in json.loads(f.read_text()) for row in d["steps"]]
    return {"source_arch": "sm90", "target_arch": "sm90", "low": round(min(errors), 4), "high": round(max(errors), 4),
            "what": f"the decode step projected between two Hopper GPUs against the step measured there ({len(files)} "
                    "same-code H200 SXM / H100 SXM pairs, both directions, M = 1, 64, 256; each GPU by the product's "
                    "fit of its results)",
            "source": "the five pairs' cross-GPU checks, docs/validation.md"}


def box() -> dict:
    rows = json.loads((HERE / "box-rtx-pro-6000-x8-pcie" / "box.json").read_text())["published"]
    errors = [r["residual"] for r in rows]
    return {"source_arch": "sm90", "target_arch": "sm120", "low": round(min(errors), 4), "high": round(max(errors), 4),
            "what": f"the TPOT projected from Hopper results against {len(rows)} published figures of 8x RTX PRO 6000 "
                    "boxes (no MTP, DCP 1, context 0; their fp8 KV, trained routing and SM120 kernels not modelled), "
                    "not a step measured here",
            "source": "the box's TPOT against its published figures, docs/validation.md"}


def main() -> None:
    doc = ("The projection's measured error per pair of SM designs (projected / truth - 1, lowest and highest), "
           "read by project.band; written by validation/projection/bands.py. A pair not listed prints 'error not "
           "measured'.")
    print(json.dumps({"_doc": doc, "bands": [hopper(), box()]}, indent=1))


if __name__ == "__main__":
    main()
