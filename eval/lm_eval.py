"""``python -m eval.lm_eval [lm_eval's arguments]``: lm-eval's own command line, with this repo's model.

    python -m eval.lm_eval --model focused --model_args run=runs/tiny,device=cpu,batch_size=8 \\
        --tasks hellaswag --include_path eval/tasks --metadata data_dir=/path/to/eval-data --limit 20

lm-eval 0.4 finds models in its own registry only (``lm_eval.models.MODEL_MAPPING``; no plugin entry
points), so the plain ``lm_eval`` command never sees ``focused``. This wrapper imports ``eval.harness``,
which registers it, then hands the same arguments to lm-eval's entry point (``lm_eval.__main__``), so every
lm-eval option works as documented there. ``--include_path`` defaults to this package's eval/tasks
(ready-to-use YAMLs: ``--tasks hellaswag`` selects ``focused_hellaswag``, which reads the local files; see
docs/eval.md for the data directory). A bad ``model_args`` or data directory is one ``error:`` line.
"""

from __future__ import annotations

import sys

from core.errors import ConfigError


def _with_task_dir(argv: list[str]) -> list[str]:
    """``argv`` plus ``--include_path <eval/tasks>`` when it names none (and runs a model at all)."""
    from eval.harness import TASK_DIR

    if any(a == "--include_path" or a.startswith("--include_path=") for a in argv):
        return argv
    if not any(a in ("--model", "--tasks", "-t") or a.startswith(("--model=", "--tasks=")) for a in argv):
        return argv  # help, ls, validate ...: leave lm_eval's own behaviour alone
    return [*argv, "--include_path", str(TASK_DIR)]


def main(argv: list[str] | None = None) -> int:
    from lm_eval.__main__ import cli_evaluate

    import eval.harness  # noqa: F401  (registers lm_eval model "focused")

    args = _with_task_dir(list(sys.argv[1:] if argv is None else argv))
    saved = sys.argv
    sys.argv = ["lm_eval", *args]  # lm_eval's CLI reads sys.argv itself
    try:
        cli_evaluate()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse errors and --help
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
