"""What crosses a process boundary: messages and their codec, a worker's position, the errors told apart."""
