"""Command-line tools: calibration of a cluster's links (``calibrate``, ``moe-calibrate``) and the
emulated cluster (``cluster``, ``moe-cluster``)."""
