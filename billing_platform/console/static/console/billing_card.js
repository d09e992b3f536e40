// The billing page's card form: Stripe Elements puts Stripe's own card field (a frame from
// js.stripe.com) in #card-element, the SetupIntent is confirmed in the browser with its
// client secret (the card goes to Stripe, never to us; 3-D Secure opens in Stripe's frame),
// and then the completion form tells the server which SetupIntent to take the card from.
// Loaded only when the server has STRIPE_PUBLISHABLE_KEY; the CSP forbids inline scripts, so
// the key and the client secret come from the page's json_script element.
"use strict";

document.addEventListener("DOMContentLoaded", () => {
  const config = document.getElementById("stripe-setup");
  const form = document.getElementById("card-form");
  if (!config || !form || typeof window.Stripe !== "function") return;
  const { publishable_key: publishableKey, client_secret: clientSecret } =
    JSON.parse(config.textContent);
  const stripe = window.Stripe(publishableKey);
  const card = stripe.elements().create("card");
  card.mount("#card-element");
  const errors = document.getElementById("card-errors");
  const button = document.getElementById("card-submit");
  card.on("change", (event) => {
    errors.textContent = event && event.error ? event.error.message : "";
  });
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    button.disabled = true;
    errors.textContent = "";
    const result = await stripe.confirmCardSetup(clientSecret, { payment_method: { card } });
    if (result.error) {
      errors.textContent = result.error.message;
      button.disabled = false;
      return;
    }
    document.getElementById("card-complete").submit();
  });
});
