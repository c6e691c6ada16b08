"""The former name of :mod:`hf_kernattn.push` (publishing a checkpoint on the Hub); its names are
re-exported here so that ``from hf_kernattn.hub import push_folder`` keeps working."""

from .push import PICKLE_SUFFIXES, PUSH_PATTERNS, PushError, exit_not_pushed, files_to_push, network_errors, push_folder

__all__ = ["PICKLE_SUFFIXES", "PUSH_PATTERNS", "PushError", "exit_not_pushed", "files_to_push", "network_errors",
           "push_folder"]
