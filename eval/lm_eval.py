"""``python -m eval.lm_eval [lm_eval's arguments]``: lm-eval's own command line, with this repo's model.

    python -m eval.lm_eval --model focused --model_args run=runs/tiny,device=cpu,batch_size=8 \\
        --tasks hellaswag --include_path eval/tasks --metadata data_dir=/path/to/eval-data --limit 20

lm-eval 0.4 finds models in its own registry only (``lm_eval.models.MODEL_MAPPING``; no plugin entry
points), so the plain ``lm_eval`` command never sees ``focused``. This wrapper imports ``eval.harness``,
which registers it, then hands the same arguments to lm-eval's entry point (``lm_eval.__main__``), so every
lm-eval option works as documented there. ``--include_path`` defaults to this package's eval/tasks
(ready-to-use YAMLs named ``focused_<task>``, which read the local files; see docs/eval.md for the data
directory); with it, ``--tasks hellaswag`` is rewritten to ``focused_hellaswag`` (our tasks never take a
built-in's name, so nothing is shadowed), and a ``batch_size`` in ``model_args`` is also passed as
``--batch_size`` so that lm-eval's summary reports the one used. A bad ``model_args`` or data directory is
one ``error:`` line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from core.errors import ConfigError, cli_errors, require


def _with_task_dir(argv: list[str]) -> list[str]:
    """``argv`` plus ``--include_path <eval/tasks>`` when it names none (and runs a model at all); with that
    folder, ``--tasks`` names of its tasks become their lm-eval names (``hellaswag`` -> ``focused_hellaswag``),
    and ``--batch_size`` is taken from ``model_args`` when only they give one (lm-eval reports the CLI's)."""
    from eval.harness import TASK_DIR

    given = _value(argv, "--include_path")
    if given is None and not any(
        a in ("--model", "--tasks", "-t") or a.startswith(("--model=", "--tasks=")) for a in argv
    ):
        return argv  # help, ls, validate ...: leave lm_eval's own behaviour alone
    out = list(argv) if given is not None else [*argv, "--include_path", str(TASK_DIR)]
    if given is None or Path(given).resolve() == TASK_DIR.resolve():
        out = _renamed_tasks(out)
    batch = _model_arg(_value(out, "--model_args") or "", "batch_size")
    if batch is not None and _value(out, "--batch_size") is None:
        out += ["--batch_size", batch]
    return out


def _value(argv: list[str], flag: str, short: str = "") -> str | None:
    """The value of ``flag`` (``--flag V`` or ``--flag=V``, or ``short V``) in ``argv``, else None."""
    for i, arg in enumerate(argv):
        if arg in (flag, short) and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _renamed_tasks(argv: list[str]) -> list[str]:
    """Our tasks are ``focused_<task>`` inside lm-eval and never take a built-in's name (that would shadow
    it, with a warning per task on every run); the plain names still select them here."""
    from eval.lm_tasks import LM_EVAL_PREFIX, TASKS

    def rename(value: str) -> str:
        return ",".join(LM_EVAL_PREFIX + t if t in TASKS else t for t in value.split(","))

    out = list(argv)
    for i, arg in enumerate(out):
        if arg in ("--tasks", "-t") and i + 1 < len(out):
            out[i + 1] = rename(out[i + 1])
        elif arg.startswith("--tasks="):
            out[i] = "--tasks=" + rename(arg.split("=", 1)[1])
    return out


def _model_arg(model_args: str, key: str) -> str | None:
    """``key``'s value in lm-eval's ``model_args`` (``k=v,k=v`` or a JSON object), else None."""
    text = model_args.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text).get(key)
        except (ValueError, AttributeError):
            return None
        return None if value is None else str(value)
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if sep and name.strip() == key:
            return value.strip()
    return None


@cli_errors
def main(argv: list[str] | None = None) -> int:
    require("lm_eval", "python -m eval.lm_eval")
    import lm_eval.models  # noqa: F401  (registers lm-eval's own models, hf ...: its CLI alone does not here)
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
