"""``kvcompile``: work with result files written by ``pytest --kv-report-json``.

    kvcompile merge cpu.json gpu.json -o report.html   # also -o report.md / report.json, by extension

merges the results of separate runs (``-n`` workers written apart, a CPU job and a GPU job) into
one report. A file that is not valid JSON, has another ``schema_version`` or misses keys is an
error naming the file and the problem (exit status 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .reports import WRITERS, write
from .reports.json_file import ResultsFileError, load
from .results import MergeError, merge


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcompile", description="Work with pytest-kvcompile result files "
                                     "(written by pytest --kv-report-json=FILE).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    merge_cmd = commands.add_parser("merge", help="merge result files into one report",
                                    description="Merge result files (several runs or jobs) into one report.")
    merge_cmd.add_argument("inputs", nargs="+", metavar="RESULTS.json", help="files written by --kv-report-json")
    merge_cmd.add_argument("-o", "--output", required=True, metavar="FILE",
                           help=f"the merged report; its format follows the extension: {', '.join(WRITERS)}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    output = Path(args.output)
    if output.suffix.lower() not in WRITERS:
        parser.error(f"-o {args.output}: unknown report format {output.suffix!r}; end the name in one of {', '.join(WRITERS)}")
    try:
        merged = merge([load(path) for path in args.inputs])
    except (ResultsFileError, MergeError) as exc:
        parser.error(str(exc))
    write(merged, output)
    print(f"kvcompile: merged {len(args.inputs)} file(s), {len(merged['rows'])} row(s) -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
