"""torch.distributed.checkpoint folders: ``.metadata`` record stand-ins and the chunk reader."""
