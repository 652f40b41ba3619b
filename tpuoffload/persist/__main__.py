"""``python -m tpuoffload.persist checkpoint DIR [--wait SECONDS]`` (see request.py)."""

import sys

from tpuoffload.persist.request import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] != "checkpoint":
        print("usage: python -m tpuoffload.persist checkpoint DIR [--wait SECONDS]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(args[1:]))
