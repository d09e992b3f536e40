// The console's behaviour, declared in the markup with data attributes instead of inline
// handlers (the Content-Security-Policy allows scripts from this site only):
//   <button data-copy="#id">      copies that element's text, then says "Copied"
//   <form data-confirm="message"> asks before it is submitted
//   <select data-autosubmit>      submits its form when changed
"use strict";

document.addEventListener("click", (event) => {
  const button = event.target.closest("[data-copy]");
  if (!button) return;
  const source = document.querySelector(button.dataset.copy);
  navigator.clipboard.writeText(source.textContent.trim()).then(() => {
    button.textContent = "Copied";
  });
});

document.addEventListener("submit", (event) => {
  const message = event.target.dataset.confirm;
  if (message && !window.confirm(message)) event.preventDefault();
});

document.addEventListener("change", (event) => {
  if (event.target.matches("select[data-autosubmit]")) event.target.form.submit();
});
