"""The trainer's side: session client, agent-episode driver, torch batches, and the engines."""
