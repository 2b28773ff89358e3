"""``kvcompile``: merge result files, draw the conformance matrix, and check an engine in a venv of its own.

    kvcompile merge cpu.json gpu.json -o report.html   # also -o report.md / report.json, by extension
    kvcompile matrix reports/*.json -o docs/conformance-matrix.md   # engines x checks (or .html)
    kvcompile check-engine vllm                        # venv + install + suites + reports

`merge` joins the results of separate runs (``-n`` workers written apart, a CPU job and a GPU job)
into one report. A file that is not valid JSON, has another ``schema_version`` or misses keys is an
error naming the file and the problem (exit status 2). `check-engine`: see check_engine.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pytest_kvcompile import check_engine
from pytest_kvcompile.reports import WRITERS, matrix, write
from pytest_kvcompile.reports.json_file import ResultsFileError, load
from pytest_kvcompile.reports.live import atomic_write
from pytest_kvcompile.verdicts.record import MergeError
from pytest_kvcompile.verdicts.results import merge


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcompile", description="Work with pytest-kvcompile result files "
                                     "(written by pytest --kv-report-json=FILE).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    merge_cmd = commands.add_parser("merge", help="merge result files into one report",
                                    description="Merge result files (several runs or jobs) into one report.")
    merge_cmd.add_argument("inputs", nargs="+", metavar="RESULTS.json", help="files written by --kv-report-json")
    merge_cmd.add_argument("-o", "--output", required=True, metavar="FILE",
                           help=f"the merged report; its format follows the extension: {', '.join(WRITERS)}")
    matrix_cmd = commands.add_parser(
        "matrix", help="the conformance matrix (engines x checks) of result files",
        description="Draw one page of engines x checks from the engines' result files: each cell pass, fail "
        "(linking the engine's findings page), known finding or skip (with the reason), with versions and dates.")
    matrix_cmd.add_argument("inputs", nargs="+", metavar="RESULTS.json",
                            help="files written by --kv-report-json, or folders of them (every *.json inside)")
    matrix_cmd.add_argument("-o", "--output", required=True, metavar="FILE",
                            help=f"the page; its format follows the extension: {', '.join(matrix.WRITERS)}")
    matrix_cmd.add_argument("--pages", type=Path, default=Path("docs/engines"),
                            help="the engines' findings pages, NAME.md for the engines NAME and NAME-* "
                            "(default: docs/engines)")
    check = commands.add_parser(
        "check-engine", help="run the suites on an engine in a virtual environment of its own",
        description="Create (or reuse) a venv, install torch, the engine and this project, run the conformance "
        "suites on the engine and write JSON and Markdown reports. Arguments after -- go to pytest.")
    check.add_argument("engines", nargs="*", metavar="NAME", help="engine NAME(s) sharing one environment")
    check.add_argument("--all", action="store_true",
                       help="every built-in engine, one run per environment, into OUT/GROUP.DTYPE.json (the files "
                       "`kvcompile matrix OUT` draws); with --only GROUP and --dtype DTYPE")
    check.add_argument("--only", action="append", default=[], metavar="GROUP",
                       help="with --all: only this group (repeatable; e.g. builtin, vllm, llamacpp)")
    check.add_argument("--dtype", action="append", default=[], metavar="DTYPE", dest="dtypes",
                       help="with --all: the model dtype (repeatable; default float32), each engine where it "
                       "declares the dtype")
    check.add_argument("--venv", type=Path, help="the venv directory (default: .kvcompile-venvs/NAME)")
    check.add_argument("--install", action="append", default=[], metavar="SPEC",
                       help="extra pip requirement (repeatable); required for engines without a built-in recipe")
    check.add_argument("--out", type=Path, default=Path("reports"), help="where the reports go (default: reports/)")
    check.add_argument("--recreate", action="store_true", help="delete the venv first")
    check.add_argument("--system-site-packages", action="store_true",
                       help="let the venv see this environment's packages (faster when the engine's pins allow)")
    check.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[: len(argv) - len(pytest_args) - (1 if "--" in argv else 0)])
    if args.command == "check-engine":
        if args.all == bool(args.engines):
            parser.error("check-engine: name the engine(s) to check, or --all for every built-in engine")
        if not args.all and (args.only or args.dtypes):
            parser.error("check-engine: --only and --dtype go with --all (for one engine: -- --kv-dtype=DTYPE)")
        try:
            if args.all:
                return check_engine.run_all(args.out, args.only, args.dtypes, pytest_args, args.recreate,
                                            args.dry_run)
            return check_engine.run(args.engines, args.venv, args.out, args.install, pytest_args, args.recreate,
                                    args.system_site_packages, args.dry_run)
        except check_engine.CheckEngineError as exc:
            parser.error(str(exc))
    output = Path(args.output)
    if args.command == "matrix":
        return _matrix(parser, args.inputs, output, args.pages)
    if output.suffix.lower() not in WRITERS:
        parser.error(f"-o {args.output}: unknown report format {output.suffix!r}; "
                     f"end the name in one of {', '.join(WRITERS)}")
    try:
        merged = merge([load(path) for path in args.inputs])
    except (ResultsFileError, MergeError) as exc:
        parser.error(str(exc))
    write(merged, output)
    print(f"kvcompile: merged {len(args.inputs)} file(s), {len(merged.rows)} row(s) -> {output}")
    return 0


def _matrix(parser: argparse.ArgumentParser, inputs: list[str], output: Path, pages: Path) -> int:
    if output.suffix.lower() not in matrix.WRITERS:
        parser.error(f"-o {output}: unknown matrix format {output.suffix!r}; end the name in one of "
                     f"{', '.join(matrix.WRITERS)}")
    try:
        page = matrix.page(inputs, output, pages)
    except (ResultsFileError, MergeError) as exc:
        parser.error(str(exc))
    atomic_write(output, page.text)
    for warning in page.warnings:
        print(f"kvcompile matrix: warning: {warning}", file=sys.stderr)
    print(f"kvcompile: matrix of {page.engines} engine(s) from {len(page.files)} file(s) -> {output}"
          + (f"; no report of {len(page.missing)} built-in engine(s): {', '.join(page.missing)}"
             if page.missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
