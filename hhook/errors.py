"""The errors hhook raises on every rank alike, defined at the bottom of the package so
that every layer (the codec included) can raise them without importing upward."""


class ConfigMismatchError(RuntimeError):
    """Ranks disagree on the codec configuration or on the tensor they reduce."""


class OpMismatchError(RuntimeError):
    """The compressed integer words were not combined with a plain SUM over the group."""


class RankFailedError(RuntimeError):
    """Some rank failed while encoding this tensor; every rank raises this (that rank
    raises its own exception)."""
