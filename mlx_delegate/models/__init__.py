"""Model definitions and export helpers, one file per architecture."""
