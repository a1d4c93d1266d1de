"""Run the ``mot-cag`` CLI in-process (shared by the CLI tests)."""

from __future__ import annotations

import sys


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run ``mot-cag ARGS`` through ``main()`` (errors become stderr lines and exit codes).

    Returns:
        ``(exit code, stdout, stderr)``.
    """
    from mot_cag.cli import main

    monkeypatch.setattr(sys, "argv", ["mot-cag", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = int(e.code or 0)
    cap = capsys.readouterr()
    return code, cap.out, cap.err
