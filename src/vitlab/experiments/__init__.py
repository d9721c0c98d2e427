"""Multi-run studies: the zero-shot vs fine-tuned comparison of several backbones (`compare`)."""
