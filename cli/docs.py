"""The manual's generated reference pages: every config key (from the pydantic schema), every
command's `--help` (from the CLI's parser) and every metric a run logs (from the glossary the
tests hold the runs to). Generated, so they cannot drift from the code: the test suite fails when
a committed page differs from what this writes.

    python -m meshrl.cli.docs          # rewrite docs/reference/{config,cli,metrics}.md
    python -m meshrl.cli.docs --check  # exit 1 if any of them is stale
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from meshrl.configs.keys import config_keys
from meshrl.configs.schema import RunConfig
from meshrl.run.metric_names import METRICS

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference"
HELP_WIDTH = "100"  # argparse wraps help to $COLUMNS: fixed, so the page does not depend on a terminal


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_page() -> str:
    """One table per top-level section, keys in schema order."""
    lines = [
        "# Config keys",
        "",
        "Every key of a run config, generated from the schema (`meshrl config keys` prints the same). Set a key",
        "in a TOML preset (`[trainer]` / `lr = 3e-4`) or on the command line (`--trainer.lr 3e-4`); see",
        "[Run configs](run-configs.md). A tagged union's members appear as `loss[tis].cap` (set as `loss.cap`",
        'with `loss.type = "tis"`); a list of them as `teachers.members[].backend`.',
    ]
    keys = config_keys()
    sections = [""] + [name for name in RunConfig.model_fields if any(k.section == name for k in keys)]
    for section in sections:
        described = RunConfig.model_fields[section].description if section else "The run itself."
        lines += ["", f"## {section or 'run'}", "", described or "", ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for k in keys:
            if k.section == section:
                lines.append(f"| `{k.key}` | {_cell(k.type)} | `{_cell(k.default)}` | {_cell(k.description)} |")
    return "\n".join(lines) + "\n"


def _commands(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _commands(sub, f"{name} {sub_name}")


def cli_page() -> str:
    from meshrl.cli.main import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        lines = ["# Command line", "", "Every `meshrl` command and its options, as `--help` prints them."]
        for name, parser in _commands(build_parser(), "meshrl"):
            parser.prog = name
            lines += ["", f"## `{name}`", "", "```text", parser.format_help().rstrip(), "```"]
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return "\n".join(lines) + "\n"


def metrics_page() -> str:
    lines = [
        "# Metrics",
        "",
        "Every key a run writes to `metrics.jsonl` (one strict JSON record per step, null where a value is NaN",
        "or infinite; the same keys go to TensorBoard and W&B, which skip those). `<name>` stands for a family",
        "of keys. Some keys appear only with the feature that logs them.",
    ]
    for group, entries in METRICS.items():
        lines += ["", f"## {group}", "", "| key | meaning |", "|---|---|"]
        lines += [f"| `{key}` | {_cell(meaning)} |" for key, meaning in entries.items()]
    return "\n".join(lines) + "\n"


PAGES = {"config.md": config_page, "cli.md": cli_page, "metrics.md": metrics_page}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write or check the manual's generated reference pages")
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed page is stale")
    args = parser.parse_args(argv)
    stale = []
    for name, render in PAGES.items():
        path, text = REFERENCE / name, render()
        if path.exists() and path.read_text() == text:
            continue
        stale.append(str(path))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print(f"stale: {', '.join(stale)} (run python -m meshrl.cli.docs)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
