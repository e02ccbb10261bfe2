"""Suite-wide settings: single-threaded torch (tiny models run fastest that way on 2 cores,
and several test processes/actors share the machine)."""
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import torch  # noqa: E402

torch.set_num_threads(1)
