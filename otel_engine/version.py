"""The package's version, in one place: `pyproject.toml` reads it from here (setuptools'
`attr:`), and telemetry and crash dumps import it from here, not from the package root
(which would load the whole engine)."""

__version__ = "0.1.0"
