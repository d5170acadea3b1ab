"""The leaf layer every package builds on: errors, atomic files, config loading and overrides,
device/dtype resolution and RNG state. It imports nothing first-party."""
