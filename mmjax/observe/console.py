"""Logging for the command-line entry points: the console shows what a person needs, the log file everything.

Console (stderr): warnings and errors from any library (except Orbax's notices about a checkpoint opened
read-only), and mmjax's own progress lines, except the kernel dispatcher's per-shape implementation
choices and the per-array parameter table. Log file (`<train.output_dir>/train.log`, one per process when
there are several): every INFO record, including Orbax's and JAX's start-up details.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# INFO lines of these loggers go to the log file only (kernel choices per shape, the per-array parameter table)
QUIET_ON_CONSOLE = ("mmjax.kernels", "mmjax.observe.params.arrays")
# Orbax warns about what mmjax does on purpose when it opens a checkpoint to read it: log file only
ORBAX_NOTICES = ("Given directory is read only", "CheckpointManagerOptions.read_only=True",
                 "Metadata file does not exist")


class ConsoleFilter(logging.Filter):
    """Warnings and errors from everyone; INFO only from mmjax loggers not in `QUIET_ON_CONSOLE`."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        if record.levelno == logging.WARNING and name == "absl" and record.getMessage().startswith(ORBAX_NOTICES):
            return False
        if record.levelno >= logging.WARNING:
            return True
        if not (name == "mmjax" or name.startswith("mmjax.")):
            return False
        return not any(name == q or name.startswith(q + ".") for q in QUIET_ON_CONSOLE)


class _OrbaxNoticesAsInfo(logging.Filter):
    """Orbax's `ORBAX_NOTICES` as INFO records: mmjax opens checkpoints read-only on purpose, so they warn nobody
    who uses the library (a handler at INFO, such as the run's log file, still records them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and record.getMessage().startswith(ORBAX_NOTICES):
            if not logging.getLogger(record.name).isEnabledFor(logging.INFO):
                return False  # as an INFO record it would not have been logged at all
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def demote_orbax_notices() -> None:
    """Make Orbax's read-only notices INFO on the `absl` logger, whatever handlers the application has (the
    library's readers call this; the command-line filter above does the same for the console)."""
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxNoticesAsInfo) for f in absl.filters):
        absl.addFilter(_OrbaxNoticesAsInfo())


def _handler(name: str) -> logging.Handler | None:
    return next((h for h in logging.getLogger().handlers if h.get_name() == name), None)


def setup_console_logging(level: int = logging.INFO) -> None:
    """Route logging to a filtered console handler; like `logging.basicConfig`, nothing is added when the
    root logger already has handlers (an embedding application's or a test runner's)."""
    root = logging.getLogger()
    root.setLevel(level)
    if not root.handlers:
        console = logging.StreamHandler(sys.stderr)
        console.set_name("mmjax-console")
        console.setFormatter(logging.Formatter(FORMAT))
        console.addFilter(ConsoleFilter())
        root.addHandler(console)


def log_to_file(path: str | Path) -> Path:
    """Also append every record to `path` (replacing an earlier log file of this process)."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    close_log_file()
    handler = logging.FileHandler(path)
    handler.set_name("mmjax-file")
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.getLogger().addHandler(handler)
    return path


def close_log_file() -> None:
    handler = _handler("mmjax-file")
    if handler is not None:
        logging.getLogger().removeHandler(handler)
        handler.close()


def log_file_name() -> str:
    """`train.log`, or `train.process_<i>.log` once jax.distributed runs several processes (no backend
    is started here: a single-process run's backend start stays under the trainer's watchdog)."""
    import jax

    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return "train.log"
    return f"train.process_{jax.process_index()}.log"
