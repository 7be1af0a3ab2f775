"""Hydra's config files read once per test process: the suite composes the recipe's config a few
hundred times in-process (every preflight test composes its own overrides), and about half of each
compose (~0.3 s) is reading and parsing the same YAML files again.

:func:`install` wraps the ``load_config`` of Hydra's two config sources the recipe uses (files:
the recipe's config folder; ``pkg://``: verl's config in its package) with a cache of what each file
gave, keyed by the source, the file and, for files, their size and modification time (a test that
writes a config file is read afresh). Every call returns a deep copy, so what Hydra does to a loaded
config never reaches the cache. Composition itself (defaults lists, overrides, merging) is Hydra's,
unchanged; the commands tests run in subprocesses compose without the cache.
"""

from __future__ import annotations

import copy
import os
from dataclasses import replace

_CACHE: dict[tuple, object] = {}


def _file_key(source, config_path: str):
    full = os.path.realpath(os.path.join(source.path, source._normalize_file_name(config_path)))
    try:
        stat = os.stat(full)
    except OSError:
        return None  # not there: Hydra's own load_config raises its error
    return (stat.st_mtime_ns, stat.st_size)


def _cached(load_config, stamp):
    def cached_load_config(self, config_path: str):
        stamp_ = stamp(self, config_path) if stamp is not None else ()
        if stamp_ is None:
            return load_config(self, config_path)
        key = (type(self).__name__, self.path, config_path, stamp_)
        if key not in _CACHE:
            _CACHE[key] = load_config(self, config_path)
        result = _CACHE[key]
        return replace(result, config=copy.deepcopy(result.config), header=dict(result.header),
                       defaults_list=copy.deepcopy(result.defaults_list))

    cached_load_config.__wrapped__ = load_config
    return cached_load_config


def install() -> None:
    """Cache the two config sources' reads in this process (idempotent)."""
    from hydra._internal.core_plugins.file_config_source import FileConfigSource
    from hydra._internal.core_plugins.importlib_resources_config_source import ImportlibResourcesConfigSource

    for source, stamp in ((FileConfigSource, _file_key), (ImportlibResourcesConfigSource, None)):
        if not hasattr(source.load_config, "__wrapped__"):
            source.load_config = _cached(source.load_config, stamp)
