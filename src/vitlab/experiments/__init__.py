"""Multi-run studies: `compare` (zero-shot vs fine-tuned, several backbones), `transfer` (`vitlab study
transfer`: pre-train on some classes, transfer to others) and `scaling` (`vitlab study scaling`: accuracy
against training-set size, the paper's Fig. 3/4 at small scale)."""
