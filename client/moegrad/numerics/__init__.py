"""The numerics: each device profile's arithmetic emulated bit for bit, the goldens, the forward routing."""
