"""shoal's communication library: process groups, collectives and point-to-point over our own
transport (backend "shoal") or torch.distributed (backends "gloo" and "nccl"). Its public face,
torch.distributed's names, is `shoal.distributed` (api/)."""
