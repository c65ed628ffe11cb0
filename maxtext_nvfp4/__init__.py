"""maxtext-nvfp4: NVFP4 training mode for MaxText."""
__version__ = "0.1.0"
