"""The web dashboard and the Prometheus metrics (``pip install 'taskrunner-db[web]'``).

Only the ``dashboard`` and ``metrics`` commands import this package: the CLI's other
commands, the runners and the overseer never load it or prometheus-client."""


def require_prometheus_client() -> None:
    """InputError (exit 2) naming the extra to install when prometheus-client is missing."""
    from ..errors import InputError
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise InputError("the dashboard and metrics need prometheus-client: "
                         "pip install 'taskrunner-db[web]'") from None
