"""The read-only trajectory viewer at /view/ (docs/viewer.md): the page (trajectory.view) and the JSON it draws."""
