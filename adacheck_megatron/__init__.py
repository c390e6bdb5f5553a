"""AdaCheck for Megatron (megatron-core and Megatron-LM training scripts).

So far: the ``--adacheck*`` command-line flags (``flags.py``), generated from the one config
object so that every key of the DeepSpeed block has the same name here (kebab-case).
The save/load integration follows (issue 6).
"""
from .flags import add_adacheck_args, config_from_args

__all__ = ["add_adacheck_args", "config_from_args"]
