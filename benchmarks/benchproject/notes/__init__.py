"""The lightest DRF create endpoint: a three-field model, so a row measures the fixed cost."""
