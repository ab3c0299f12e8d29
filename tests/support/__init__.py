"""What the tests share, by topic: engine checks and presets, reference models, fake workers,
subprocess drivers. Test modules import from here, never from one another."""
