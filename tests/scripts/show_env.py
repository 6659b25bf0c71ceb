"""Prints the launcher's environment and its own arguments, one line per rank."""

import os
import sys

keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"]
print(" ".join(f"{k}={os.environ[k]}" for k in keys), f"SECRET={os.environ.get('SHOAL_SECRET', '')[:8]}",
      f"ARGS={sys.argv[1:]}")
