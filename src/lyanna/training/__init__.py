"""Training draft heads (torch): modules that mirror the numpy inference code, and fitting."""
