"""Test support that must also run inside Ray actors: fault injection (`faults`)."""
