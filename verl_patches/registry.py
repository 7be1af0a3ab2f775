"""How the recipe changes verl: one record per change, one helper that applies it once.

A :class:`Patch` is either a *wrap* (replace a verl attribute by ``wrapper(original)``: the
wrapper keeps the original and calls it) or a *registration* (add an entry to one of verl's own
registries through a function that is idempotent by itself). Every patch carries, as data, what a
maintainer needs when verl moves: the target, what it changes, why, the verl behaviour it relies
on, and when it can be dropped. The table of the recipe's patches is
:data:`verl_patches.install.PATCHES`; ``python -m verl_patches`` prints it.

Patches name their code by ``"module:qualified.name"`` strings, imported only when applied, so the
table can be read (docs, tests) without importing verl. :func:`apply` is the one wrap-once helper:
a wrapped attribute carries the patch's name in ``__stapo_patch__`` and the original in
``__wrapped__``, so applying twice is a no-op and a test can walk back to verl's own function.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import os
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

#: the verl release every patch was written against (requirements pin it)
VERL_VERSION = "0.9.1"
#: set to the installed verl version (or ``any``) to import the patches on another verl, with a warning
VERSION_OVERRIDE_ENV = "STAPO_ALLOW_VERL_VERSION"
#: attribute a wrapper carries: the name of the patch that installed it
MARKER = "__stapo_patch__"


@dataclass(frozen=True)
class Patch:
    """One change to verl.

    Args:
        name: short unique name (also the wrapper's ``__stapo_patch__``).
        target: what is changed, ``"module:attr"`` or ``"module:Class.attr"`` (for a
            registration: the registry).
        changes: what the recipe's version does differently.
        why: what the recipe needs it for.
        relies_on: the verl behaviour the patch assumes, in words (``anchors``: what :func:`check`
            looks up).
        drop_when: the verl change that makes the patch unnecessary.
        wrapper: ``"module:function"``, ``function(original) -> replacement`` (a wrap).
        register: ``"module:function"``, an idempotent zero-argument registration (instead of
            ``wrapper``); ``registered`` (``"module:function"``) tells whether it is in place.
        applies: ``"module:function"`` returning False where the patch must stay off in this
            process (e.g. a CUDA machine for a CPU-only fix); None: always.
        anchors: source text the patch relies on, each a short piece of the target's module (whitespace
            runs count as one space), or of another file as ``"verl/path/file.py: text"``; a wrap's
            anchors start with its target's ``def`` line (as much of it as the wrapper relies on).
        obsolete_if: text (an anchor) whose presence means upstream made the patch unnecessary.
    """

    name: str
    target: str
    changes: str
    why: str
    relies_on: str
    drop_when: str
    wrapper: Optional[str] = None
    register: Optional[str] = None
    registered: Optional[str] = None
    applies: Optional[str] = None
    anchors: tuple[str, ...] = ()
    obsolete_if: Optional[str] = None

    def __post_init__(self):
        if (self.wrapper is None) == (self.register is None):
            raise ValueError(f"patch {self.name}: give exactly one of wrapper= and register=")
        if self.register is not None and self.registered is None:
            raise ValueError(f"patch {self.name}: a registration needs registered= to tell whether it is in place")
        if ":" not in self.target:
            raise ValueError(f"patch {self.name}: target {self.target!r} must read 'module:attribute'")

    @property
    def kind(self) -> str:
        return "wrap" if self.wrapper is not None else "register"


def resolve(ref: str) -> Any:
    """The object ``"module:qualified.name"`` names (the module is imported)."""
    module, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def _owner_and_attr(target: str) -> tuple[Any, str]:
    """``(object holding the attribute, attribute name)`` of a ``"module:[Class.]attr"`` target."""
    module, _, qualname = target.partition(":")
    owner, _, attr = qualname.rpartition(".")
    return resolve(f"{module}:{owner}"), attr


def _call(ref: Optional[str]) -> Any:
    return resolve(ref)() if ref is not None else True


def is_applied(patch: Patch) -> bool:
    """True when ``patch`` is in place in this process."""
    if patch.kind == "register":
        return bool(_call(patch.registered))
    owner, attr = _owner_and_attr(patch.target)
    return getattr(getattr(owner, attr), MARKER, None) == patch.name


def applies_here(patch: Patch) -> bool:
    """False when the patch's ``applies`` condition keeps it off in this process."""
    return bool(_call(patch.applies))


def apply(patch: Patch) -> bool:
    """Apply ``patch`` once: True when this call changed something, False when it was in place
    already or does not apply in this process."""
    if not applies_here(patch) or is_applied(patch):
        return False
    if patch.kind == "register":
        resolve(patch.register)()
        return True
    owner, attr = _owner_and_attr(patch.target)
    original = getattr(owner, attr)
    replacement = resolve(patch.wrapper)(original)
    try:
        setattr(replacement, MARKER, patch.name)
        replacement.__wrapped__ = original
    except AttributeError as exc:  # e.g. a builtin: a wrapper must return a plain Python object
        raise TypeError(f"patch {patch.name}: the wrapper's result {replacement!r} cannot carry a marker") from exc
    setattr(owner, attr, replacement)
    return True


class _PostImportHooks(importlib.abc.MetaPathFinder):
    """A finder that runs callbacks right after a named module executes (it finds nothing itself:
    the module is loaded by the finder that would have loaded it)."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callable[[], Any]]] = {}

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        callbacks = self.pending.pop(name)
        exec_module = spec.loader.exec_module

        def exec_then_call(module):
            exec_module(module)
            for callback in callbacks:
                callback()

        spec.loader.exec_module = exec_then_call
        return spec


_HOOKS = _PostImportHooks()


def apply_on_import(patch: Patch) -> bool:
    """Apply ``patch`` now when its target's module is loaded (True when this call changed
    something), else once that module is first imported in this process (or in a process forked
    from it); False. So only the processes that load a module pay for importing it (verl's trainer and
    engine cost a process ~2 CPU-seconds, vLLM more; most of a run's ~10 verl processes load neither)."""
    module = patch.target.partition(":")[0]
    if module in sys.modules:
        return apply(patch)
    if _HOOKS not in sys.meta_path:
        sys.meta_path.insert(0, _HOOKS)
    callbacks = _HOOKS.pending.setdefault(module, [])
    if not any(getattr(cb, "patch", None) == patch.name for cb in callbacks):
        callback = functools.partial(apply, patch)
        callback.patch = patch.name  # type: ignore[attr-defined]
        callbacks.append(callback)
    return False


def original_of(obj: Any) -> Any:
    """verl's own object under any number of the recipe's wraps."""
    while getattr(obj, MARKER, None) is not None:
        obj = obj.__wrapped__
    return obj


def check_verl_version(installed: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
                       warn: Callable[[str], None] = lambda msg: warnings.warn(msg, stacklevel=3)) -> str:
    """Refuse a verl release other than :data:`VERL_VERSION` (returns the installed version).

    ``installed`` defaults to the installed distribution's version. ``STAPO_ALLOW_VERL_VERSION``
    set to that version (or to ``any``) lets it through with a warning: for trying a newer verl,
    against which the patches are checked first (:func:`check`).
    """
    if installed is None:
        try:
            installed = version("verl")
        except PackageNotFoundError:
            installed = getattr(importlib.import_module("verl"), "__version__", "unknown")
    if installed == VERL_VERSION:
        return installed
    environ = os.environ if environ is None else environ
    allowed = environ.get(VERSION_OVERRIDE_ENV, "").strip()
    if allowed in (installed, "any"):
        warn(f"verl_patches: written for verl {VERL_VERSION}, running on verl {installed} "
             f"({VERSION_OVERRIDE_ENV}={allowed}); check the patches against it: python -m verl_patches check")
        return installed
    raise RuntimeError(
        f"verl_patches: the recipe patches verl {VERL_VERSION}, but verl {installed} is installed. "
        f"Install the pinned release (pip install verl=={VERL_VERSION}, see requirements.txt), or, to try "
        f"this one anyway, check the patches against it (python -m verl_patches check) and set "
        f"{VERSION_OVERRIDE_ENV}={installed}.")


def _source(where: str, verl_source: Optional[str]) -> tuple[str, Optional[str]]:
    """``(path, text)`` of a module (``"verl.trainer.main_ppo"``) or a file (``"verl/trainer/main_ppo.py"``),
    read, never imported: verl's under ``verl_source`` when given, another package's beside its installed
    top-level package; ``text`` None where there is no such file."""
    base = where.replace(".", "/")
    paths = [where] if where.endswith(".py") else [f"{base}/__init__.py", f"{base}.py"]
    top = paths[0].split("/")[0]
    if verl_source is not None and top == "verl":
        root = Path(verl_source)
    else:
        spec = importlib.util.find_spec(top)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        root = Path(locations[0]).parent if locations else None
    for path in paths:
        if root is not None and (root / path).is_file():
            return path, (root / path).read_text(errors="replace")  # the anchors are ASCII: a stray byte is no error
    return paths[-1], None


def _missing(anchor: str, module: str, verl_source: Optional[str]) -> Optional[str]:
    """None when ``anchor`` is in its file (``module``'s unless it names one; a run of whitespace counts
    as one space), else what is missing."""
    file, in_file, rest = anchor.partition(".py: ")
    where, wanted = (f"{file}.py", rest) if in_file else (module, anchor)
    path, text = _source(where, verl_source)
    if text is None:
        return f"no file {path}"
    return None if " ".join(wanted.split()) in " ".join(text.split()) else f"{wanted!r} not in {path}"


def check(patches: Sequence[Patch], verl_source: Optional[str] = None) -> list[tuple[str, str, str]]:
    """Look up what each patch relies on in verl's source files, read as text, never imported: the
    installed verl's, or those of the checkout ``verl_source`` (``verl_source/verl/...``); targets in
    another package (vLLM, torch, the standard library) in the installed one.

    Returns:
        ``(name, verdict, detail)`` per patch, in order: ``obsolete`` when its ``obsolete_if`` text is
        there, else ``breaks`` when an anchor is missing (``detail`` names each), else ``applies``.
    """
    results = []
    for patch in patches:
        module = patch.target.partition(":")[0]
        if patch.obsolete_if is not None and _missing(patch.obsolete_if, module, verl_source) is None:
            results.append((patch.name, "obsolete", f"upstream has {patch.obsolete_if!r} ({patch.drop_when})"))
            continue
        problems = [problem for problem in (_missing(a, module, verl_source) for a in patch.anchors) if problem]
        results.append((patch.name, "breaks", "; ".join(problems)) if problems else (patch.name, "applies", ""))
    return results


def main(patches: Sequence[Patch], table: Callable[[], str], command: str, argv: Sequence[str]) -> int:
    """``command`` prints ``table()``; ``command check [VERL_SOURCE]`` prints :func:`check`'s verdict on
    each patch. Returns the exit status: 1 when a patch breaks or is obsolete, 2 for bad arguments."""
    if not argv:
        print(table(), end="")
        return 0
    if argv[0] != "check" or len(argv) > 2:
        print(f"usage: {command} [check [VERL_SOURCE]]", file=sys.stderr)
        return 2
    verl_source = argv[1] if len(argv) == 2 else None
    # os.path.isfile: False, never an OSError, for a name too long
    if verl_source is not None and not os.path.isfile(os.path.join(verl_source, "verl", "__init__.py")):
        print(f"{command} check: no verl source tree in {verl_source!r} (no {verl_source}/verl/__init__.py)",
              file=sys.stderr)
        return 2
    results = check(patches, verl_source)
    for name, verdict, detail in results:
        print(f"{verdict:<8} {name}" + (f": {detail}" if detail else ""))
    verdicts = [verdict for _, verdict, _ in results]
    print(f"{verdicts.count('applies')} apply, {verdicts.count('breaks')} break, {verdicts.count('obsolete')} "
          f"obsolete (verl: {verl_source or 'installed'})")
    return int(verdicts.count("applies") < len(verdicts))


def render_table(patches, title: str, command: str, source: str, intro: list[str]) -> str:
    """A patch table as a Markdown document: ``title``, the ``command`` that prints it from the table in
    ``source``, the ``intro`` paragraphs, then one section per patch (target, changes, why, relies on,
    drop when, anchors). The docs page of each table is that output; a test keeps it in step."""
    lines = [f"# {title}", "",
             f"Generated by `{command}` from the table in `{source}` (a test keeps this file in step with it).", ""]
    for paragraph in intro:
        lines += [paragraph, ""]
    lines += [f"`{command} check [VERL_SOURCE]` looks up each entry's *anchors* in verl's source (the installed "
              "package, or a checkout), reports it *applies*, *breaks* or is *obsolete*, and exits non-zero unless "
              "every entry applies.", ""]
    for patch in patches:
        how = f"wraps with `{patch.wrapper}`" if patch.kind == "wrap" else f"registers with `{patch.register}`"
        lines += [
            f"## `{patch.name}`",
            "",
            f"- **target**: `{patch.target}` ({how})",
            f"- **changes**: {patch.changes}",
            f"- **why**: {patch.why}",
            f"- **relies on**: {patch.relies_on}",
            f"- **drop when**: {patch.drop_when}",
        ]
        anchors = [f"`{anchor}`" for anchor in patch.anchors]
        anchors += [f"obsolete once `{patch.obsolete_if}` appears"] if patch.obsolete_if is not None else []
        lines += [f"- **anchors**: {'; '.join(anchors)}", ""]
    return "\n".join(lines)
