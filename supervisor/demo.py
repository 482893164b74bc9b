"""The public name of the demo's model builder: `from supervisor.demo import make_model` (examples/, bench/).

The code is supervisor/commands/demo.py (`supervisor demo`); this module only re-exports the builder.
"""
from supervisor.commands.demo import make_model

__all__ = ["make_model"]
