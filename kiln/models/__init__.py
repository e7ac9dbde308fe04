"""Models, their layers and ops. Importing the package makes torch.library registrations cheap (op_source.py):
it is imported right after torch on every path to an engine, before the ops and the compiler register theirs."""

from kiln.models.op_source import install as _install_op_source

_install_op_source()
