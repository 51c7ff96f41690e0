"""deviceplane: the Kubernetes device-plugin framework in Python."""

__version__ = "0.1.0"
