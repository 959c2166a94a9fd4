"""Workers, controller, schedules, gradient sync and state transfer: the side-effecting edge."""
