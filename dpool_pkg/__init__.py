"""dpool: elastic data-parallel training for MLX.

The user-facing folders (protocol/, daemon/, client/, trainer/) are installed as
subpackages of this namespace; see pyproject.toml's package-dir.
"""

__version__ = "0.1.0"
