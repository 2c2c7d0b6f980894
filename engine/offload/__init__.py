"""Memory-constrained mode: models larger than the device budget, weights streamed from host memory."""
