"""The error a bad request raises: it fails that request alone, never the job."""


class InvalidRequestError(ValueError):
    """A request that cannot run; the message names the offending field."""
