"""What users run: the report (:mod:`~qkov.apps.report`), the tour (:mod:`~qkov.apps.tour`), the
dynamics study (:mod:`~qkov.apps.dynamics`), the command line (:mod:`~qkov.apps.cli`), progress
displays and the analysis text. Built on the library's public functions only; nothing below this
package imports it."""

__all__: list[str] = []

