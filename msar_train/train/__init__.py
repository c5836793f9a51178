"""Training: optimizer and schedules, the trainer loop, metrics, CLIs."""
