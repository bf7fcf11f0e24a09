"""Installs the DeepInfer CPU twin's import hooks in every process started with this directory
on PYTHONPATH (see deepinfer_twin/__init__.py)."""

import deepinfer_twin

deepinfer_twin.install()
