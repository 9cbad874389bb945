"""Errors a user can hit while choosing or loading a model. Each message says what to do."""

from __future__ import annotations


class ModelError(Exception):
    """Base class for model selection and loading errors."""


class UnsupportedModelError(ModelError, ValueError):
    """The checkpoint's architecture, rope type or format is not one this engine implements."""


class CheckpointError(ModelError, ValueError):
    """The checkpoint's tensors do not match the model: missing, unexpected or mis-shaped."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """The model path or alias does not point at anything loadable."""
