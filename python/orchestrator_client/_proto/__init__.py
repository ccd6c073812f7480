"""Generated from proto/orchestrator.proto with grpcio-tools when the package is built (setup.py)."""
