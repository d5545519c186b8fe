"""Run configuration: schema, YAML loading with `extends:` and overrides, validation, resolution."""
from .dump import config_to_yaml, save_config, software_versions
from .environment import Environment
from .errors import ConfigError, ConfigWarning
from .load import config_from_dict, config_to_dict, load_config
from .resolve import resolve
from .schema import SECTIONS, RunConfig
from .validate import find_problems, find_warnings, validate

__all__ = [
    "RunConfig", "SECTIONS", "load_config", "validate", "find_problems", "find_warnings", "resolve",
    "ConfigError", "ConfigWarning",
    "save_config", "config_to_yaml", "config_from_dict", "config_to_dict", "software_versions",
    "Environment",
]
