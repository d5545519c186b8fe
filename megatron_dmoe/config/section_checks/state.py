"""What one check of a configuration keeps while its section checks run (config/section_checks/*.py)."""
from __future__ import annotations

from typing import Any, List, Optional

from ..environment import Environment
from ..errors import Problem
from ..resolve import DERIVED_FROM
from ..schema import RunConfig


class CheckState:
    """The config under check, the problems and warnings found so far, and the keys found invalid.

    The value checks (config/section_checks/values.py) fill `bad` and then `sane` (the config with its
    invalid values replaced by schema defaults) and `resolved` (`sane` with derived defaults
    filled); the cross-key checks read values through `raw`, `v` and `ok`.
    """

    def __init__(self, cfg: RunConfig, world_size: Optional[int], env: Optional[Environment]):
        self.cfg = cfg
        self.world_size = world_size
        self._env = env
        self.problems: List[Problem] = []
        self.warnings: List[Problem] = []  # settings that run, but likely not as meant
        self.bad: set = set()  # keys whose own value is wrong; checks that read them are skipped
        self.sane: Optional[RunConfig] = None
        self.resolved: Optional[RunConfig] = None

    @property
    def env(self) -> Environment:
        if self._env is None:
            self._env = Environment.detect()
        return self._env

    def problem(self, key: str, message: str, *, bad: bool = False) -> None:
        self.problems.append((key, message))
        if bad:
            self.bad.add(key)

    def warn(self, key: str, message: str) -> None:
        self.warnings.append((key, message))

    def raw(self, key: str) -> Any:
        """The value as given (a schema default where the given one has the wrong type)."""
        section, name = key.split(".")
        return getattr(getattr(self.sane, section), name)

    def v(self, key: str) -> Any:
        """The value after resolve() (derived defaults filled)."""
        section, name = key.split(".")
        return getattr(getattr(self.resolved, section), name)

    def ok(self, *keys: str) -> bool:
        """True when none of ``keys`` (nor what their derived default comes from) is invalid."""
        for key in keys:
            if key in self.bad:
                return False
            if self.raw(key) is None and not self.ok(*DERIVED_FROM.get(key, ())):
                return False
        return True
