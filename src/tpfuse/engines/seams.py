"""The engine internals a plugin hooks, and the check that they are all there before it hooks any.

A plugin of tpfuse's replaces functions inside a serving engine (vLLM, SGLang). Engines move their
internals between releases without notice (SGLang 0.5.23 moved its layers' all-reduce + norm boundary
to ``srt/layers/layer_boundary/``); a plugin that finds its target gone must fail at start-up, naming
the engine's version and what is missing, never run on as if nothing happened with tpfuse unused.

Each plugin lists its seams (:class:`Seam`: where, and what tpfuse does there) with the engine versions
it was run against and read against; :func:`check` resolves every seam, logs which it found when the
engine's version is neither, and raises :class:`SeamMissing` when a required one is gone.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

__all__ = ["Seam", "SeamMissing", "StartUpStopped", "check", "resolve", "base_version"]


@dataclass(frozen=True)
class Seam:
    """One place inside an engine: ``target`` is ``"package.module:Attr.attr"`` (the module imported,
    then the attributes followed); ``use`` says what tpfuse does there (for the error and the log).
    ``required``: the plugin cannot do its job without it (missing: :func:`check` raises); else it is
    used where the engine has it (a newer release's extra helper)."""

    target: str
    use: str
    required: bool = True


class SeamMissing(RuntimeError):
    """A seam a plugin needs is not in the installed engine: its message names the engine, its version
    and each missing target."""


class StartUpStopped(SystemExit):
    """A :class:`SeamMissing` raised through an engine's plugin loader that catches a plugin's ``Exception``
    and starts without it (SGLang's ``load_plugins`` logs it and serves on, tpfuse unused): a ``SystemExit``
    that loader lets through, so start-up stops. Its message (``code``) is the ``SeamMissing``'s."""


def resolve(target: str):
    """The object at ``target`` (``"module:attr.attr"``), or raise ``LookupError`` saying why not."""
    module_name, _, attributes = target.partition(":")
    try:
        found = importlib.import_module(module_name)
    except ImportError as exc:  # the module is gone, or imports what is gone
        raise LookupError(f"module {module_name} does not import ({exc})") from exc
    for attribute in filter(None, attributes.split(".")):
        try:
            found = getattr(found, attribute)
        except AttributeError as exc:
            raise LookupError(f"{module_name} has no {attributes}") from exc
    return found


def base_version(version: str) -> str:
    """``"0.32.0+cpu"`` -> ``"0.32.0"``: builds of one release (CPU, CUDA) share its source."""
    return version.split("+", 1)[0]


def check(engine: str, version: str, seams: tuple[Seam, ...], run_against: tuple[str, ...],
          read_against: tuple[str, ...], log: logging.Logger, log_unknown: bool = True) -> dict[str, object]:
    """Resolve ``seams`` in the installed ``engine`` (of ``version``): ``{target: object}`` of those found.

    On a version in neither ``run_against`` nor ``read_against`` it logs (WARNING, unless ``log_unknown``
    is false) which seams it found and which it did not. A required seam that is missing raises
    :class:`SeamMissing` with the engine's version, the missing targets, what tpfuse does at each and the
    versions tpfuse knows.
    """
    found, missing = {}, []
    for seam in seams:
        try:
            found[seam.target] = resolve(seam.target)
        except LookupError as exc:
            missing.append((seam, str(exc)))
    known = base_version(version) in run_against + read_against
    if not known and log_unknown:
        log.warning("tpfuse: %s %s is not a version tpfuse's plugin was run against (%s) or read against "
                    "(%s); seams found: %s; not found: %s", engine, version, ", ".join(run_against),
                    ", ".join(read_against), ", ".join(found) or "none",
                    ", ".join(seam.target for seam, _ in missing) or "none")
    required = [(seam, why) for seam, why in missing if seam.required]
    if required:
        lines = "\n".join(f"  - {seam.target} (tpfuse {seam.use}): {why}" for seam, why in required)
        raise SeamMissing(
            f"tpfuse's {engine} plugin cannot run on {engine} {version}: it lacks what the plugin hooks:\n"
            f"{lines}\n"
            f"tpfuse's plugin was run against {engine} {', '.join(run_against)} and read against "
            f"{', '.join(read_against)}. Install one of those, or a tpfuse that supports {engine} {version}.")
    for seam, why in missing:
        log.info("tpfuse: %s %s has no %s (%s); tpfuse %s only where it exists", engine, version, seam.target,
                 why, seam.use)
    return found
