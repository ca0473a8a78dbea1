"""``python -m inspector.demo OUT_DIR``: write the demo checkpoints."""

import sys

from inspector.demo import build_demo

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m inspector.demo OUT_DIR")
    for name, path in build_demo(sys.argv[1]).items():
        print(f"{name:9s} {path}")
