// A target written in JavaScript: rdq's worker invokes it with the task's envelope as the event,
// and what it returns becomes the task's result.
exports.handler = async (event) => {
  const { a, b } = event.payload;
  return {
    sum: a + b,
    runtime: `node ${process.versions.node}`,
    task_id: event.task_id,
    queue: event.queue,
    handler: event.handler,
    attempt: event.attempt,
  };
};
