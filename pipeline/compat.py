"""Command line of the compatibility check (the library is eagle3/compat.py).

  python -m pipeline.compat --drafter runs/x/train/round-000/drafter --target smollm2 [--json]

Exit 0 when compatible, 1 otherwise; every mismatch is listed with the field, both sides and the
fix. Rope and max positions only warn. With two drafters (`--target` also has an EAGLE-3 config)
they are compared config field by field and tensor by tensor.
"""

from __future__ import annotations

import argparse
import json
import sys

from eagle3.compat import CompatReport, Row, check_compat  # noqa: F401  (re-exported)


def main(argv: list[str] | None = None, prog: str = "python -m pipeline.compat") -> int:
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog=f"example:\n  {prog} --drafter drafters/smollm2-135m-offpolicy --target smollm2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--drafter", required=True, help="drafter folder or HF repo id")
    ap.add_argument(
        "--target", required=True, help="target folder, HF repo id, `smollm2`, or a second drafter"
    )
    ap.add_argument("--drafter-revision", default=None)
    ap.add_argument("--target-revision", default=None)
    ap.add_argument("--gguf-file", default=None, help="GGUF file inside --target")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    rep = check_compat(
        args.drafter,
        args.target,
        drafter_revision=args.drafter_revision,
        target_revision=args.target_revision,
        gguf_file=args.gguf_file,
    )
    print(json.dumps(rep.to_json(), indent=2, default=str) if args.json else rep.table())
    return 0 if rep.compatible else 1


if __name__ == "__main__":
    sys.exit(main())
